"""FedML 0.9.6 adapter of the FedMITR core (runner, client trainer, server aggregator, config
reading, offline init, receive-loop fixes). Submodules are imported on demand: ``config`` is
FedML-free; ``trainer``, ``aggregator``, ``runner``, ``registry`` need FedML."""
