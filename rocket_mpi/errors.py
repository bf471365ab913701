"""One exception type for every user-facing failure.

A RocketError carries one line that names what was wrong (file, tensor, flag,
rank, peer, layer, step). The CLI prints it and exits non-zero; under mpirun
it aborts the whole job so no rank is left waiting.
"""


class RocketError(Exception):
    """A failure the user can act on; str(e) is the one line we print."""


class CheckpointError(RocketError):
    pass


class ConfigError(RocketError):
    pass


class FabricError(RocketError):
    pass


class FabricTimeout(FabricError):
    pass
