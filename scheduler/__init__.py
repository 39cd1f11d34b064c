"""Request lifecycle and continuous-batching scheduler. Pure Python: no torch, no engine imports."""

from scheduler.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.config import SchedulerConfig
from scheduler.params import SamplingParams
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
