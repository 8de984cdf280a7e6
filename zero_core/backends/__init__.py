"""Backends move the data of `zero_core.dist`'s collectives: the virtual cluster's, or torch.distributed's.

`base` holds the interface and the reduction contract both keep; `virtual` the rank threads' rendezvous;
`torch_distributed` a real process group under torchrun (imported on use, as `zero_core.launch` does);
`faulty` wraps either to make one rank die or hang on purpose.
"""
