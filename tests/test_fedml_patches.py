"""FedML behind one door: each receive-loop fix is applied only where FedML's code has the bug,
nothing is patched under another FedML version, and the CLI's offline fetch_config lasts only for
its fedml.init."""
import pytest


def test_each_loop_fix_applies_only_where_the_bug_is():
    from fedml.core.distributed.communication.grpc.grpc_comm_manager import GRPCCommManager
    from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager

    from fedml_fedmitr.fedml_adapter import fedml_patches as fp

    grpc_loop = GRPCCommManager.__dict__.get("__fedmitr_original_subroutine__",
                                             GRPCCommManager.message_handling_subroutine)
    assert fp.grpc_loop_needs_fix(grpc_loop)          # FedML 0.9.6: spins and unpickles anything
    assert not fp.grpc_loop_needs_fix(fp._grpc_message_handling_subroutine)
    mpi_loop = MpiCommunicationManager.handle_receive_message
    if not getattr(mpi_loop, "__fedmitr_fix__", False):
        assert fp.mpi_loop_needs_fix(mpi_loop, MpiCommunicationManager._free_q)
    assert not fp.mpi_loop_needs_fix(fp._mpi_handle_receive_message, fp._mpi_free_q)


def test_another_fedml_version_patches_nothing(monkeypatch):
    from fedml.core.distributed.communication.mpi.com_manager import MpiCommunicationManager

    from fedml_fedmitr.fedml_adapter import fedml_patches as fp
    from fedml_fedmitr.fedml_adapter.errors import UserError

    before = MpiCommunicationManager.handle_receive_message
    monkeypatch.setattr(fp, "installed_fedml_version", lambda: "0.9.9")
    monkeypatch.setattr(fp, "_REGISTERED", False)
    for patch in (fp.register, fp.fix_mpi_loop, fp.fix_grpc_loop, fp.install_offline_fetch_config):
        with pytest.raises(UserError, match="supports FedML 0.9.6, found 0.9.9"):
            patch()
    assert MpiCommunicationManager.handle_receive_message is before


def test_the_offline_fetch_config_lasts_only_for_the_block():
    import fedml.core.mlops as mlops

    from fedml_fedmitr.fedml_adapter import fedml_patches as fp

    registered = getattr(mlops.fetch_config, "__fedmitr_offline__", False)
    fp.uninstall_offline_fetch_config()
    try:
        original = mlops.fetch_config
        with fp.offline_fetch_config_installed():
            assert getattr(mlops.fetch_config, "__fedmitr_offline__", False)
        assert mlops.fetch_config is original
    finally:
        if registered:   # as the process had it
            fp.install_offline_fetch_config()


def test_a_second_run_in_one_process_logs_to_the_new_handlers(monkeypatch):
    """FedML sets up new log handlers on each fedml.init; the plugin's logger follows them and never
    keeps writing to the first run's (possibly closed) streams; a logger someone else set up stays."""
    import io
    import logging

    from fedml_fedmitr.fedml_adapter.runner import attach_plugin_logging

    plog = logging.getLogger("fedml_fedmitr.test_attach")   # not the plugin's own: its state stays
    plog.handlers = []
    first, second = logging.StreamHandler(io.StringIO()), logging.StreamHandler(io.StringIO())
    monkeypatch.setattr(logging.root, "handlers", [first])
    attach_plugin_logging(plog)
    assert plog.handlers == [first]
    monkeypatch.setattr(logging.root, "handlers", [second])   # the next fedml.init
    attach_plugin_logging(plog)
    assert plog.handlers == [second]
    plog.warning("resume: true but nothing is saved")
    assert "resume: true but" in second.stream.getvalue() and first.stream.getvalue() == ""
    mine = logging.StreamHandler(io.StringIO())
    plog.handlers = [mine]
    plog._fedmitr_attached = []
    attach_plugin_logging(plog)
    assert plog.handlers == [mine]
