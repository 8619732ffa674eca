"""``method.auto_select``: lambda / rho / alpha chosen without labels, on a held-out part of the calibration examples.

``options`` (the options, grids and candidates, as plain data), ``policy`` (the per-block choice, criterion
``objective``, as the loop's hyperparameter policy), ``search`` (the search for every criterion, then the final
calibration).
"""
