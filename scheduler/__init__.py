"""Request lifecycle and continuous-batching scheduler. Pure Python: no torch, no engine imports."""

from scheduler.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.config import LookaheadConfig, SchedulerConfig
from scheduler.lookahead import LookaheadLayout, LookaheadState, NGramPool
from scheduler.params import LookaheadParams, SamplingParams
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

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
