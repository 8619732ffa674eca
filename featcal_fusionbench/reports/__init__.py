"""What a run or a sweep left behind, read back and shown: runs found in a folder and their scores, a sweep's
table and picture, a run's drift picture, runs side by side (``featcal-report``)."""
