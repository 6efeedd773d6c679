package com.llmd;

/** An installed model. */
parcelable ModelInfo {
    @utf8InCpp String id;
    @utf8InCpp String architecture;
    int layers;
    int contextLength;
    int vocabSize;
    long weightBytes;
    boolean hasChatTemplate;
}
