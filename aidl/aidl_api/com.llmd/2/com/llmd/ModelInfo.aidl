package com.llmd;

/** An installed model. */
@RustDerive(Clone=true, PartialEq=true)
parcelable ModelInfo {
    @utf8InCpp String id;
    @utf8InCpp String architecture;
    int layers;
    int contextLength;
    int vocabSize;
    long weightBytes;
    boolean hasChatTemplate;
}
