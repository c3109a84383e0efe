import sys

from easyckpt_agent.cli import main

sys.exit(main())
