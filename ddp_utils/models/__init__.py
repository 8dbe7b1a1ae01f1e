"""Networks: the backbones and the linear probe (``backbones``), MoCo (``moco``) and its shuffle
BN (``shuffle_bn``)."""
