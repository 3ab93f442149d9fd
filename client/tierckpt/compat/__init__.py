"""Drop-in replacements for other checkpointing clients' APIs, over tierckpt.

`tierckpt.compat.sagemaker`: SageMaker HyperPod's ``amzn-sagemaker-checkpointing``
(`SageMakerCheckpointConfig`, `SageMakerTieredStorageWriter`/`Reader`, its exceptions):
change one import and keep the training script.
"""
