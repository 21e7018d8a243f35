"""The semantic rules over typed configs, one module per part, each a pure
function from a Struct to ``ConfigProblem``s (YAML path, reason): ``edge``
(the edge config, section by section in file order), ``providers`` (one
provider entry), ``routing`` (``provider_pool.routing``), ``node`` (the node
config), all writing to ``collect.Errors``.  ``load.py`` turns the problems
into ``path: reason`` lines; a refresh validates the new file the same way.
"""

from iopd.config.rules.edge import validate_edge_config
from iopd.config.rules.node import validate_node_config

__all__ = ["validate_edge_config", "validate_node_config"]
