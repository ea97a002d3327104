"""The outer rounds of the shared groups and of replicated experts: what a round puts on the wire (``wire``), how
contributions travel (``transport``), the gathered round (``gathered``) and its signed records (``records``), group
states for joiners and reloads (``state``), one group's averager (``averager``), the rounds run in the background of
training (``background``) and the rounds among an expert's owners (``replicas``)."""
