"""The scheduler's limits and choices, as one frozen record (EngineConfig's scheduling fields, checked)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from conveyor.core.config import check_option, check_partial_prefills


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # a name in policies.POLICY_CLASSES: the policy built when none is handed over
    preemption_mode: str = "recompute"  # or "swap": copy the victim's KV to CPU and back
    tenant_weights: Mapping[str, float] = field(default_factory=dict)  # the fair policy's; unnamed tenants weigh 1
    max_num_partial_prefills: int = 1  # prompts computed in chunks side by side (see prefill.py)
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # 0: 4% of max_model_len
    # Load shedding and deadlines (admission.py): caps on the waiting queue, refusing a request its TTFT target
    # cannot be met for, the targets a request without its own gets (seconds), and a cache salt per tenant.
    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    admission_control: bool = False
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    tenant_cache_salt: bool = False

    def __post_init__(self) -> None:
        """The rules of EngineConfig's fields of the same names (``policy`` is its ``scheduling_policy``)."""
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "preemption_mode",
                     "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold"):
            check_option(name, getattr(self, name))
        check_option("scheduling_policy", self.policy)
        check_partial_prefills(self.max_num_partial_prefills, self.max_long_partial_prefills)
        for name in ("max_num_queued_requests", "max_num_queued_tokens"):
            check_option(name, getattr(self, name))
        for name in ("ttft_slo", "tpot_slo"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


