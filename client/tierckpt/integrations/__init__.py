"""Backends for checkpointing libraries other than DCP; each module imports its library
only when used (`pip install 'tierckpt[torch-checkpointing]'`)."""
