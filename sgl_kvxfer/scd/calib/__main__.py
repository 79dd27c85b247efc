from sgl_kvxfer.scd.calib.calibrate import main

main()
