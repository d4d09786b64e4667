"""The operator's clients of the topics: ``edgemesh devices`` (``devices``) and ``edgemesh ctl`` (``ctl``)."""
