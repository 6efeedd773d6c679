package com.llmd;

/** The daemon at a glance. */
@RustDerive(Clone=true, PartialEq=true)
parcelable ServiceStatus {
    int interfaceVersion;
    int modelsInstalled;
    int sessionsOpen;
    int requestsQueued;
    int requestsRunning;
    long kvCacheBytes;
    long weightBytes;
}
