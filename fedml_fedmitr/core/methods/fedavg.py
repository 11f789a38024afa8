"""One-shot FedAvg: the sample-weighted average of the uploaded weights, no server training."""
from __future__ import annotations

from torch import nn

from ..models import fedavg_state_dict, load_state_checked
from . import register_method
from .base import ServerContext, ServerMethod


@register_method
class OneShotFedAvg(ServerMethod):
    name = "OneShotFedAvg"
    needs_synthesis = False
    forced = ("student_init",)   # always the average, whatever student_init says

    def synthesize(self, ctx: ServerContext):
        return None

    def distill(self, pool, ctx: ServerContext) -> nn.Module:
        # the student was initialised by prepare(); FedAvg always averages, whatever student_init says
        load_state_checked(self.student, fedavg_state_dict(ctx.global_uploads(self.uploads, "OneShotFedAvg")),
                           "FedAvg of the client models")
        return self.student
