"""The model as the runtime builds it: reference decoders from a ModelSpec, the loss, and
meta-device materialisation of each rank's shards."""
