"""Pure tensor math of FeatCal: nothing here knows a model, a hook or a device.

``hparams`` (the method's values, checked), ``moments`` (streamed input moments), ``block_sums`` (one block's sums over
tasks), ``solver`` (the closed forms: Eq. 17, 55, 59), ``objective`` (a candidate's held-out objective), ``meters``
(drift and agreement), ``sampling`` (the seeded calibration examples and their held-out split). It imports nothing
else of the package.
"""
