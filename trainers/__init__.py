"""Lightning modules and data modules that train dynts models (predictor, testbed LRM/helper/PRM)."""
