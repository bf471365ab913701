"""One exception type for every user-facing failure.

A RocketError carries one line that names what was wrong (file, tensor, flag,
rank, peer, layer, step). The CLI prints it and exits non-zero; under mpirun
it aborts the whole job so no rank is left waiting.
"""


class RocketError(Exception):
    """A failure the user can act on; str(e) is the one line we print."""

    everywhere = False  # True when every rank raised the same error: rank 0 alone prints it


class AgreedError(RocketError):
    """An error every rank reached together (handshake, collective set-up): all exit cleanly, rank 0 says why."""

    everywhere = True


class CheckpointError(RocketError):
    pass


class ConfigError(RocketError):
    pass


class FabricError(RocketError):
    pass


class FabricTimeout(FabricError):
    pass
