"""``torchrun ... -m easyckpt.agents``: the name the standalone launcher had before it moved to
``easyckpt.node.launcher``; kept so that existing launch scripts keep working."""
import sys

from easyckpt.node.launcher import main

if __name__ == "__main__":
    sys.exit(main())
