"""Speculative decoding in the simulator: drafts and their acceptance drawn from a profile measured on the real
engine, so the simulator predicts the speed-up drafts give a workload.

The simulator's requests have no text, so no proposer could find a repetition in them. What a workload's
drafts look like is measured instead (``conveyor bench speculative --profile-out``, from the engine's
counters): how many drafts the proposer offered a decoding request in a step (0 to
``num_speculative_tokens``), and, for each position in a draft, the share of drafts carried there that
were accepted. The simulated proposer offers drafts of those lengths, and the simulated executor accepts
each position with the chance that it is accepted given the one before it was. Everything else is the
engine's own: the scheduler carries the drafts (``auto`` chooses how many from the simulated step costs),
the cost model prices the verify rows, and the KV manager holds and frees their slots.

Pure Python, like the rest of the simulator.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from conveyor.core.config import EngineConfig
from conveyor.core.request import Request
from conveyor.core.spec import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class AcceptanceProfile:
    """``proposal_lengths[n]``: the share of decoding request-steps offered n drafts; ``acceptance[i]``: the
    share of drafts carried at position i that were accepted (every earlier one was accepted too)."""

    proposal_lengths: tuple[float, ...]
    acceptance: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.proposal_lengths) != len(self.acceptance) + 1:
            raise ValueError("acceptance profile: proposal_lengths needs one entry more than acceptance "
                             f"(0 to {len(self.acceptance)} drafts), got {len(self.proposal_lengths)}")
        if any(not 0 <= x <= 1 for x in (*self.proposal_lengths, *self.acceptance)) or not self.proposal_lengths:
            raise ValueError("acceptance profile: every share must lie in [0, 1]")
        if abs(sum(self.proposal_lengths) - 1) > 1e-6:
            raise ValueError(f"acceptance profile: proposal_lengths must sum to 1, got {sum(self.proposal_lengths)}")

    @classmethod
    def from_stats(cls, stats: SpecDecodeStats) -> AcceptanceProfile:
        """The profile of what a real engine's counters saw (ValueError if it saw no decoding step)."""
        offered = sum(stats.proposal_lengths)
        if not offered:
            raise ValueError("acceptance profile: the engine proposed for no decoding step")
        acceptance = tuple(accepted / carried if carried else 0.0
                           for accepted, carried in zip(stats.accepted_per_position, stats.carried_per_position))
        return cls(tuple(n / offered for n in stats.proposal_lengths), acceptance)

    def conditional(self) -> tuple[float, ...]:
        """Position i's chance to be accepted once every position before it was."""
        chances, before = [], 1.0
        for share in self.acceptance:
            chances.append(min(1.0, share / before) if before > 0 else 0.0)
            before = share
        return tuple(chances)

    def to_json(self) -> dict[str, list[float]]:
        return {"proposal_lengths": list(self.proposal_lengths), "acceptance": list(self.acceptance)}

    @classmethod
    def read(cls, path: str | Path) -> AcceptanceProfile:
        try:
            fields = json.loads(Path(path).read_text())
            return cls(tuple(fields["proposal_lengths"]), tuple(fields["acceptance"]))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"acceptance profile {path}: not a profile written by `conveyor bench speculative "
                             f"--profile-out` ({error})") from None


class ProfiledProposer:
    """Offers drafts of the profile's lengths (of the simulator's one token), at random with a fixed seed."""

    def __init__(self, profile: AcceptanceProfile, token_id: int, seed: int = 0) -> None:
        self._lengths = range(len(profile.proposal_lengths))
        self._weights = profile.proposal_lengths
        self._token = token_id
        self._rng = random.Random(seed)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        length = self._rng.choices(self._lengths, self._weights)[0]
        return [self._token] * min(length, max_drafts)

    def finished(self, request: Request) -> None:
        pass


class DraftAcceptance:
    """How many of a request's drafts the simulated model accepts: each position in turn, by its chance."""

    def __init__(self, profile: AcceptanceProfile, seed: int = 0) -> None:
        self._chances = profile.conditional()
        self._rng = random.Random(f"{seed}:acceptance")

    def accepted(self, num_drafts: int) -> int:
        random_draw, chances = self._rng.random, self._chances
        for position in range(num_drafts):
            if random_draw() >= chances[position]:
                return position
        return num_drafts


def speculative_parts(config: EngineConfig, profile: AcceptanceProfile | None,
                      token_id: int = 0) -> tuple[ProfiledProposer | None, DraftAcceptance | None]:
    """The proposer and the acceptance a simulation of ``config`` runs with: none without a speculative config;
    ValueError with one and no profile (a simulated request has no text to find repetitions in)."""
    if config.speculative() is None:
        return None, None
    if profile is None:
        raise ValueError("speculative_config: the simulator needs an acceptance profile (--acceptance-profile, "
                         "written by `conveyor bench speculative --profile-out`)")
    return ProfiledProposer(profile, token_id, config.seed), DraftAcceptance(profile, config.seed)
