"""Request lifecycle and continuous-batching scheduler. Pure Python: no torch, no engine imports."""

from lookahead_serve.scheduler.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from lookahead_serve.scheduler.config import LookaheadConfig, SchedulerConfig
from lookahead_serve.scheduler.lookahead import LookaheadLayout, LookaheadState, NGramPool
from lookahead_serve.scheduler.params import LookaheadParams, SamplingParams
from lookahead_serve.scheduler.request import Request, RequestStatus
from lookahead_serve.scheduler.scheduler import Scheduler

__all__ = [
    "LookaheadConfig",
    "LookaheadLayout",
    "LookaheadParams",
    "LookaheadState",
    "NGramPool",
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
