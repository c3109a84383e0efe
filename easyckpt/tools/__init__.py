"""The offline tools behind the ``easyckpt`` command (``easyckpt.cli``): ``ls``/``verify`` (``checks``, no torch),
``status``/``clean`` (``status``) and ``convert``/``ranks-needed`` (``convert``)."""
