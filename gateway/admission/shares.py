"""Max-min fair shares of the node's capacity between API keys (issue 60).

A key's share is its demand or its weighted part of an equal split of the capacity among the
keys with demand, whichever is less; what a key leaves unused of its part goes to the others
(water-filling). Shares are real numbers: a node that holds one stream gives each of two
demanding keys half of it, which admission turns into turns (``gateway.admission``).

Pure functions over parallel sequences (a few keys per call, on the admission path when more
than one key has demand), so that the invariants are checked on their own
(tests/gateway/admission/test_fair_shares.py): the shares sum to at most the capacity, no key's share
exceeds its demand, and a key below its demand has the highest share per weight of all.
"""

from __future__ import annotations

from collections.abc import Sequence


def fair_shares(capacity: float, demands: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Each key's share of ``capacity`` (``demands[i]`` and ``weights[i]`` > 0 are key
    ``i``'s). Keys whose demand fits under the water level get their demand; the others get
    the level times their weight, the level set so that the shares use the whole capacity
    (or every demand is met)."""
    n = len(demands)
    shares = [0.0] * n
    left = max(0.0, float(capacity))
    weight = 0.0
    for i in range(n):
        if demands[i] > 0:
            weight += weights[i]
    # Keys in the order their demand per weight reaches the level.
    order = sorted((i for i in range(n) if demands[i] > 0), key=lambda i: demands[i] / weights[i])
    for k, i in enumerate(order):
        level = left / weight if weight > 0 else 0.0
        if demands[i] <= level * weights[i]:
            shares[i] = float(demands[i])
            left -= demands[i]
            weight -= weights[i]
            continue
        for j in order[k:]:  # the level binds for every key from here on
            shares[j] = level * weights[j]
        break
    return shares
