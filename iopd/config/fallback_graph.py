"""Cycles in the model groups' fallback graph, found for the config validator.

A graph algorithm of its own, apart from the checks of ``rules/``: the
validator builds the graph (group id -> its first definition's index and
fallbacks, as the catalog keeps it) and reports each cycle at the YAML path
of the edge that closes it.
"""

from __future__ import annotations

__all__ = ["fallback_cycles"]


def fallback_cycles(graph: dict[str, tuple[int, list[str]]]) -> list[tuple[str, list[str]]]:
    """Each edge that closes a cycle, as (YAML path of the edge, the cycle's group ids).

    An iterative depth-first search over the groups in file order (a long
    chain cannot exhaust the stack); self-references are reported elsewhere.
    """
    found: list[tuple[str, list[str]]] = []
    done: set[str] = set()
    for root in graph:
        if root in done:
            continue
        path: list[str] = [root]
        on_path: set[str] = {root}
        edges: list[int] = [0]  # per path entry: the next fallback index to follow
        while path:
            node = path[-1]
            index, targets = graph[node]
            j = edges[-1]
            if j == len(targets):
                done.add(node)
                on_path.discard(node)
                path.pop()
                edges.pop()
                continue
            edges[-1] = j + 1
            target = targets[j]
            if target == node or target not in graph or target in done:
                continue
            if target in on_path:
                cycle = path[path.index(target) :] + [target]
                found.append((f"models[{index}].fallbacks[{j}]", cycle))
                continue
            path.append(target)
            on_path.add(target)
            edges.append(0)
    return found
