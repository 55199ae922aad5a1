"""Hydra configs, one YAML per experiment. This file makes conf/ the package `tfmoe.conf` in installed wheels."""
