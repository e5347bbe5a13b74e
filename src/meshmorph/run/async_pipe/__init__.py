"""The asynchronous pipeline: 1F1B without flush (PipeDream), weight stashing, PipeDream-2BW and
weight prediction (SpecTrain), its action lists, and ``meshmorph run`` of an async plan."""
