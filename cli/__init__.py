"""Nitro's entry points, above ``flows/``: the ``nitro`` command line (``cli.main``) and
``nitro experiment`` (``cli.experiment``). The core, ``nitro/``, imports none of this."""
