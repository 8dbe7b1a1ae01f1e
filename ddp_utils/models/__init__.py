"""Networks: the backbones (``backbones``) and MoCo's encoders, queue and shuffle BN (``moco``)."""
