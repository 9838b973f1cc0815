"""KV groups: which layers share a block table (vLLM v1's KV cache groups, for its hybrid allocator).

A model whose layers all attend to the whole context has one group of all its layers: a block holds
``block_size`` tokens' K/V in every layer, as it always did. A model with windowed layers (Gemma 3: five
layers in six see the last 512 positions; Mistral: every layer its ``sliding_window``) splits its layers
into groups of one window each (None: the whole context), all groups of the same number of layers. A block
of the one shared pool is then one group's K/V for ``block_size`` tokens, the same bytes whichever group
holds it, so admission and preemption count every group's blocks against one pool. A windowed group's
table gives back the blocks its window has passed (``NULL_BLOCK`` in their place, so an entry's index stays
its logical block), while a full group keeps the whole context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = -1  # a windowed table's entry for a block behind the window: given back, never read


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that keep the same tokens' K/V: the whole context (``window`` None), or the last ``window``."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The model's layers in KV groups of equal size; group 0 is a full-attention one where there is one."""

    groups: tuple[KVGroup, ...]

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """Every layer in one group over the whole context: the layout without windows."""
        return cls((KVGroup(None, tuple(range(num_layers))),))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        return len(self.groups[0].layers)

    @property
    def num_layers(self) -> int:
        return self.num_groups * self.layers_per_group

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def windowed(self) -> bool:
        """Whether some group gives back blocks behind a window."""
        return any(window is not None for window in self.windows)

    def layer_slots(self) -> list[tuple[int, int]]:
        """Per layer: (its group, its index in the group), which is where its K/V lie in the cache tensor."""
        slots: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for index, layer in enumerate(group.layers):
                slots[layer] = (g, index)
        return [slots[layer] for layer in range(self.num_layers)]


def kv_layout(layer_windows: Sequence[int | None], num_layers: int, max_model_len: int) -> KVLayout:
    """The KV groups of a model whose layer ``i`` attends to ``layer_windows[i]`` positions (None: all).

    A window no sequence can exceed (``>= max_model_len``) never binds, so it counts as full attention. The
    group size is the greatest common divisor of the layer counts of each window: no group is padded, and
    Gemma 3 270M's 3 full and 15 windowed layers make 6 groups of 3.
    """
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows]
    if len(windows) != num_layers or not any(w is not None for w in windows):
        return KVLayout.single(num_layers)
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))  # full attention first, then by window
    groups = [KVGroup(window, tuple(by_window[window][start : start + size]))
              for window in order for start in range(0, len(by_window[window]), size)]
    return KVLayout(tuple(groups))
