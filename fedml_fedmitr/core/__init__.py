"""FedMITR core: torch + timm only (never imports fedml).

Where things live: models and the token-subset forward (``models``), the client ensemble
(``ensemble``), stage 1 sparse model inversion (``inversion``), stage 2 token relabel
distillation and its loss (``distill``), client training (``client``), partitions
(``partition``), evaluation (``evaluate``), hyperparameters by section (``config``), server methods
(``methods``: FedMITR and the baselines behind one interface), the one server pipeline and output
writer (``server``: ``run_one_shot``), pictures and metric reporting (``report``).
"""
from .config import ClientTrainConfig, ConfigError, FedMITRConfig
from .methods import ClientUpload, ServerContext, ServerMethod, ServerResult, get_method, method_names
from .models import ModelError, create_vit, load_global_model, save_global_model
from .server import RunInfo, run_one_shot

__all__ = ["ClientTrainConfig", "ConfigError", "FedMITRConfig", "ClientUpload", "ServerContext",
           "ServerMethod", "ServerResult", "get_method", "method_names", "ModelError", "create_vit",
           "load_global_model", "save_global_model", "RunInfo", "run_one_shot"]
