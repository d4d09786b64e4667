"""A whole cluster on one machine: broker processes (``broker``, ``embedded``), the process spawner
(``processes``) and ``edgemesh demo`` (``demo``)."""
