"""`python -m ember_sidecar`: the same as the `ember-sidecar` console script."""

from ember_sidecar.main import main

main()
