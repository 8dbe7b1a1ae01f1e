"""Networks: the backbones (``backbones``), MoCo (``moco``) and its shuffle BN (``shuffle_bn``),
and the linear probe (``probe``)."""
