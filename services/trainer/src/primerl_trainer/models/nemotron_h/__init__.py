"""Nemotron-H (transformers `nemotron_h`): Mamba-2, attention and MoE layers."""
