"""rocket_mpi: decode a Mixture-of-Experts LLM with its routed experts split over MPI ranks,
bit-exactly the tokens one rank decodes."""

__version__ = "0.1.0"
