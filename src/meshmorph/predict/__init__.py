"""What-if on hardware you do not have: CM-DARE's speed and revocation fits, the cloud catalog,
a discrete-event simulation of a run on transient GPUs (``simulate``) and advice (``advise``).
Imports no torch."""
