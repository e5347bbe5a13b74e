"""Charts: loss curves, pipeline timelines, memory per stage."""
