"""The HTML pages: runs, a run, the new-run form (:mod:`.runs`), several runs compared
(:mod:`.compare`), the fleet (:mod:`.nodes`), login, the federation and the admin page with its
forms (:mod:`.misc`), the offline Swagger UI at ``/docs`` (:mod:`.docs`); :mod:`.common` renders a
page with its user, CSRF token and flash message."""
