"""Entry points, run as ``python -m scripts.X`` from the repository root.

Importing this package (which ``python -m scripts.X`` does before the module) keeps Hugging Face
libraries offline unless the user set ``HF_HUB_OFFLINE`` (:func:`drafttrain.assets.offline_by_default`).
"""

from drafttrain.assets import offline_by_default

offline_by_default()
