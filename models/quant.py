"""The old home of the quantized-target code, now split by job; kept only for ``train/quant_experiment.py``,
which imports from here until it moves to ``lab/``. New code imports the module that does the job:

- ``models.quantization``: the ``target.quantization`` values (``parse_quantization``, ``check_bits_group``)
- ``models.dequantize``: MLX affine checkpoints read in torch (``models.target.load_mlx_target`` loads one)
- ``models.quantize``: a bf16 target quantized with mlx_lm (``quantize_to_mlx``), ``resolve_target``
- ``models.provenance``: the "trained against" line (``trained_against``)
"""

from models.quantization import check_bits_group  # noqa: F401
from models.quantize import quantize_to_mlx  # noqa: F401
