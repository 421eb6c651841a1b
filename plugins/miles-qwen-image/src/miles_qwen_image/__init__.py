"""miles-core plugin for the Qwen-Image family (``QwenImagePipeline``).

The entry point is :mod:`miles_qwen_image.plugin`; the family is
:class:`miles_qwen_image.family.QwenImageFamily`.
"""
