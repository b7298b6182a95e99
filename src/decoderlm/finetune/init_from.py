"""What a fine-tune may change in the model it starts from (`decoderlm train --init-from SRC`,
whose source `decoderlm.io.load.load_source` loads): `finetune_config`."""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import UserError

__all__ = ["finetune_config"]


def finetune_config(source: ModelConfig, overrides: dict) -> ModelConfig:
    """The source's ModelConfig with `overrides` applied; only dropout may differ from it.

    Raises:
        UserError: an override changes the model's shape (the message names each flag).
    """
    config = ModelConfig.from_dict({**source.to_dict(), **overrides})
    clashes = [
        f"--{k.replace('_', '-')} {overrides[k]} (the source has {k} {v!r})"
        for k, v in source.to_dict().items()
        if k != "dropout" and k in overrides and getattr(config, k) != v
    ]
    if clashes:
        raise UserError(
            f"{'; '.join(clashes)}: with --init-from the model's shape comes from the source; "
            f"drop those flags (only --dropout and the training settings may change)"
        )
    return config
