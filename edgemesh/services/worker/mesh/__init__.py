"""A worker as a member of a model-parallel cluster: its slices (``member``), the exchange of slices
between members (``exchange``) and its membership (``session``)."""
