package com.llmd;

/** How urgent a request is; the daemon caps it by what the caller may claim. */
@Backing(type="int")
enum Priority {
    FOREGROUND = 0,
    BACKGROUND = 1,
    BATCH = 2,
}
