"""`python -m kvyard`: start the roles named by ROLE_TYPE."""
import sys

from kvyard.launch import main

sys.exit(main())
