"""attn-check's two batteries (the recipe is :mod:`tfmoe.experiments.attn_check`; ``settings`` holds their
frozen settings, which the recipe builds).

Module mode (``impl=``): ``module_battery`` runs the groups of ``checks/`` (one module per group, as
``checks=[...]`` names them) on a :class:`layer.LayerUnderTest`; ``heatmap`` draws the weights.
Kernel mode (``kernel=``): ``kernels`` resolves SPEC to a function, ``kernel_cases`` builds the case matrix and
its inputs, ``kernel_judging`` runs and judges one case, ``kernel_battery`` records one check per family.
The references they compare with are in ``tfmoe.components`` (references, reference_attention, comparison).
"""
