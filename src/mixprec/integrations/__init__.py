"""Adapters for training frameworks; each imports its framework only when used.

* :mod:`mixprec.integrations.lightning`: ``MixprecPrecision``, a PyTorch Lightning precision plugin.
* :mod:`mixprec.integrations.accelerate`: ``MixprecAccelerator``, a Hugging Face Accelerate ``Accelerator``.
* :mod:`mixprec.integrations.transformers`: ``MixprecTrainer``, a Hugging Face ``transformers.Trainer``.
"""
