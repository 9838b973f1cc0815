"""Speculative decoding's torch-free half: drafts proposed from the tokens a request already has, how many of
them a step carries (fixed, or chosen per step from acceptance and step cost), and the counts of what was
proposed and accepted. The executor verifies the drafts in the step that computes them (executor/speculative.py)."""

from conveyor.core.spec.config import SpeculativeConfig
from conveyor.core.spec.proposers import NgramProposer, Proposer, SuffixProposer, make_proposer
from conveyor.core.spec.speculator import SpecDecodeStats, Speculator

__all__ = ["NgramProposer", "Proposer", "SpecDecodeStats", "SpeculativeConfig", "Speculator", "SuffixProposer",
           "make_proposer"]
