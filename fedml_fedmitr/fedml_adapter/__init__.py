"""FedML 0.9.6 adapter of the FedMITR core (runner, client trainer, server aggregator, server and
client managers, settings). Every patch of FedML is in ``fedml_patches``. Submodules are imported on
demand: ``config``, ``run_checks``, ``state``, ``grpc_security`` are FedML-free; ``trainer``,
``aggregator``, ``runner``, the managers and ``fedml_patches`` need FedML."""
