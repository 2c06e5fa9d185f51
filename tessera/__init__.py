"""tessera: PyTorch-native pretraining of transformer language models."""

__version__ = "0.1.0"


def load(path):
    """The model of a tessera run/checkpoint or an HF model directory, in eval mode (see tessera.api.load)."""
    from tessera.api import load as _load

    return _load(path)
