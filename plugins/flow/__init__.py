"""The flow-matching plugin (SD3 / FLUX-style rectified-flow image and video models, Flow-GRPO family).

This package stays import-light: submodules that need diffusers import it themselves. The sampler math lives in
:mod:`mmrl.plugins.flow.sde` (pure torch, no diffusers).
"""
